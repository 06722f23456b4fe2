"""Models: traces (per-layer bytes and times), the torch side that makes them (tracer under
FakeTensor, Hugging Face configs, any module, CNNs, the model zoo, CUDA kernel semantics,
measured profiles), and the tensor-parallel shard of a trace."""
