"""The lab's GPU-host image: files the base layer gives every simulated host."""
