"""Compatibility: the old import path of inferencemesh.frontend.proposers.build.

Programs and tests outside the engine's files still import resolve_speculation from here; move
them to inferencemesh.frontend.proposers.build and delete this module.
"""

from inferencemesh.frontend.proposers.build import Speculation, resolve_speculation

__all__ = ["Speculation", "resolve_speculation"]
