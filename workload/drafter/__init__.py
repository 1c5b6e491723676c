"""The drafter: the model (z-lab's format), its view of the target, its checkpoint format."""
