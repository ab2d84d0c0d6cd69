"""The model hub: whether it can be reached, offline mode while it cannot, and its failures turned
into one CheckpointError a person can act on."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import urllib.parse
from collections.abc import Iterator

from inferencemesh.checkpoint.errors import CheckpointError

# What a hub fetch takes besides the weights: the config, generation and tokenizer files.
CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "model-package.json",
]
HUB_PROBE_TIMEOUT_S = 3.0
HUB_PROBE_TTL_S = 30.0  # a long-lived process (the operator) asks again after a while
PROXY_ENVS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_hub_probe: tuple[float, str | None] | None = None  # (when asked, why unreachable or None)


def hub_unreachable() -> str | None:
    """Why the model hub cannot be reached from here (its host refuses a TCP connection, or has no
    address or route, within HUB_PROBE_TIMEOUT_S), or None: it can, HF_HUB_OFFLINE is set (nothing
    will be asked), or a proxy is configured (the proxy decides). Asked at most once per
    HUB_PROBE_TTL_S."""
    global _hub_probe
    from huggingface_hub import constants

    if constants.is_offline_mode() or any(os.environ.get(name) for name in PROXY_ENVS):
        return None
    if _hub_probe is None or time.monotonic() - _hub_probe[0] > HUB_PROBE_TTL_S:
        url = urllib.parse.urlsplit(constants.ENDPOINT)
        port = url.port or (443 if url.scheme == "https" else 80)
        why = None
        try:
            with socket.create_connection((url.hostname or "", port), timeout=HUB_PROBE_TIMEOUT_S):
                pass
        except OSError as err:
            why = f"{url.hostname}:{port}: {err.strerror or type(err).__name__}"
        _hub_probe = (time.monotonic(), why)
    return _hub_probe[1]


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    """huggingface_hub in offline mode meanwhile, as HF_HUB_OFFLINE=1 puts it (read on every
    request: constants.is_offline_mode): cached files are used, nothing is asked or retried."""
    from huggingface_hub import constants

    if not on or constants.HF_HUB_OFFLINE:
        yield
        return
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = False


@contextlib.contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Turn huggingface_hub's failures into one CheckpointError a person can act on. When the hub
    cannot be reached (hub_unreachable: asked once), the calls inside run offline: a cached model
    still loads, an uncached one is refused at once with why, instead of after huggingface_hub's
    five retries with backoff (23 s)."""
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    unreachable = hub_unreachable()
    try:
        with _offline(unreachable is not None):
            yield
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as err:
        why = f"the model hub cannot be reached ({unreachable})" if unreachable else \
            "it is unreachable or HF_HUB_OFFLINE is set"
        raise CheckpointError(
            f"cannot fetch {repo_id} from the model hub ({why}, and the local cache lacks it): pass a local "
            "model directory, or populate the cache and set HF_HUB_OFFLINE=1"
        ) from err
    except HFValidationError as err:
        raise CheckpointError(f"{repo_id} is neither an existing directory nor a valid hub id ({err})") from err
    except OSError as err:  # requests' connection errors are OSErrors
        raise CheckpointError(f"cannot reach the model hub for {repo_id} ({type(err).__name__}): pass a local "
                              "model directory, or populate the cache and set HF_HUB_OFFLINE=1") from err
