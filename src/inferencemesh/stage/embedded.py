"""The first stage inside the frontend process: a LocalStage (local.py).

Kept under this name for the programs that still import it; new code uses
inferencemesh.stage.local, joined to the frontend by inferencemesh.programs.mesh.
"""

from __future__ import annotations

from inferencemesh.stage.local import LocalStage as EmbeddedStage

__all__ = ["EmbeddedStage"]
