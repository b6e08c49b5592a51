"""The long path: cuBLASLt Q@K^T (FP32 scores) -> native softmax -> cuBLASLt P@V, chunk by chunk."""
