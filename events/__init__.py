"""The event contracts (``.proto`` under ``events/sandbox_lanes/v1``) and their codec."""
