"""Hardware context beside the engine's telemetry: NVML, NIC, RDMA and host collectors."""
