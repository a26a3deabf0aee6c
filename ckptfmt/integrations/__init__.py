"""ckptfmt inside the frameworks people train with: one module per framework (``lightning``, ...), each
imported on its own, with that framework as an optional extra (``pip install ckptfmt[lightning]``).
The core never imports them; they use its public API and record step timing through its StepTimer.
"""
