"""The runner-credential request (spec section 3.3, C4): what a lane decision asks the edge to mint for.

The mint itself (``consumers.runtime.runner_tokens``) happens at the edge, right before the driver
call; the token is never part of a decision, a state record, an event or a log line.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

CredentialScope = Literal["session", "workflow", "connect"]


class SandboxCredentialRequest(NamedTuple):
    """The full provisioning context a capability provider decides from (C4).

    Immutable and compared by value; a NamedTuple because one is built per ensure decision.
    """

    scope: CredentialScope
    session_id: str
    execution_id: str
    org: str
    caller_identity_id: str
