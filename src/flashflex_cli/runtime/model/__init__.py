"""The model on one rank: the Llama stage, attention backends, tensor-parallel layers, the loss, initial weights, precision and torch.compile."""
