"""Test-wide settings: one compute thread for in-process models.

Stage processes started by tests use one thread too (mesh_helpers.QUIET_THREADS): several
processes share the CI machine's two cores, and oversubscribed OpenMP threads spin.
"""

import torch

torch.set_num_threads(1)
