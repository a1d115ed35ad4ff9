"""The order in which an FB row interleaves one micro-batch's forward with another's backward.

An FB row runs the forward of one (microbatch, chunk) and the full backward of another stage by
stage, in the order of a small table over the five layer stages, Pith-Train's by default
(``FB_ORDER``): a token like "B5+1" runs, on the backward side, the next stages whose
``Stage.role`` number (``ROLES``: attn=1, dispatch=2, mlp=3, combine=4, aggregate=5; 0 for the
embed, head and other roles, which run with the token that reaches them) is in {5, 1}, at most one
stage per role, so a cycle of the tokens walks one layer of each side; "B3i" runs an input-only B
(its W waits for a "W3" token).
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe.stages.spec import LAYER_ROLES, Stage

__all__ = ["FB_ORDER", "ROLES", "FBStep", "parse_fb_order", "role"]

# the FB order's role numbers: attn=1, dispatch=2, mlp=3, combine=4, aggregate=5
ROLES = {name: i + 1 for i, name in enumerate(LAYER_ROLES)}
FB_ORDER = "B5+1 | F4 | B4 | F5+1 | B3i | F2 | B2 | W3 | F3"


@dataclass(frozen=True)
class FBStep:
    """One token of an FB order: side "F", "B" or "W"; the layer-stage roles it runs; for B, whether
    only the input gradient runs now (the W waits for a later W token of that role)."""

    side: str
    roles: frozenset[int]
    input_only: bool = False


def parse_fb_order(text: str) -> tuple[FBStep, ...]:
    """'B5+1 | F4 | B3i | W3 | ...' -> FBSteps. Every side must name every role 1..5 once per cycle."""
    steps = []
    for tok in (t.strip() for t in text.split("|")):
        if not tok:
            continue
        side, rest = tok[0].upper(), tok[1:]
        input_only = rest.endswith("i")
        rest = rest.removesuffix("i")
        try:
            roles = frozenset(int(x) for x in rest.split("+"))
        except ValueError:
            raise ValueError(f"FB order token {tok!r}: expected like 'F4', 'B5+1' or 'B3i'") from None
        if side not in "FBW" or not roles <= set(ROLES.values()) or (input_only and side != "B"):
            raise ValueError(f"FB order token {tok!r}: side F/B/W, roles 1..5, 'i' only after B")
        steps.append(FBStep(side, roles, input_only))
    for side in "FB":
        covered = sorted(r for s in steps if s.side == side for r in s.roles)
        if covered != [1, 2, 3, 4, 5]:
            raise ValueError(f"FB order {text!r}: side {side} must name each role 1..5 once, got {covered}")
    deferred = {r for s in steps if s.input_only for r in s.roles}
    named_w = {r for s in steps if s.side == "W" for r in s.roles}
    if deferred - named_w:
        raise ValueError(
            f"FB order {text!r}: input-only B of roles {sorted(deferred - named_w)} has no W token"
        )
    return tuple(steps)


def role(stage: Stage) -> int:
    """The FB order's number of a stage's ``role`` (0: not one of the five layer roles)."""
    return ROLES.get(stage.role, 0)
