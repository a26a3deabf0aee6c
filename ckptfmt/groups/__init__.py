"""Who saves together: the ranks of a save and the collectives between them.

``ranks.py`` says what a save needs of its group (``Ranks``) and gives the group
of one, this process alone (``SoloRanks``: no collectives); ``process_group.py``
gives the ranks of a torch.distributed process group (``RankGroup``). The save
pipeline (``saving/pipeline.py``) runs the same protocol on either. ``nodes.py``
says which node each member is on (``NodeLayout``), for node-scoped saves and
the manager's peer copies alike. What a process with process groups does before
its interpreter shuts down is ``ckptfmt/_teardown.py``, below every layer that
touches a group.
"""
