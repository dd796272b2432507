"""Deployment: the Envoy gateway config, Kubernetes manifests, and `fleet` (replicas + Envoy on one machine)."""
