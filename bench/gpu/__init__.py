"""The H200 validation kit of issue 6: random-weight Qwen3-shaped engines, token-id workloads, and the kernel,
engine and gRPC benchmarks that bench/gpu_check.sh runs in one go (each also runs tiny on the CPU)."""
