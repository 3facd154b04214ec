"""Sandbox drivers: one module per tier of the isolation ladder behind one contract."""
