"""Credentials for the Kubernetes API, shared by the operator and the router."""

from __future__ import annotations

import os
from typing import Any


def load_api_client() -> Any:
    """A kubernetes ApiClient: in a pod, its service account; elsewhere $KUBECONFIG or ~/.kube/config.

    $KUBECONFIG is read now: the kubernetes package reads it once, when it is first imported, and a
    process that sets it later (a test's control plane) would otherwise get ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return client.ApiClient()
