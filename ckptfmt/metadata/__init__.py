"""What a checkpoint records about the run that wrote it, beside the state: RNG states, software and
hardware environment, distributed topology, per-rank save phases, and the StepTimer's training steps
(spec section 9).
"""
