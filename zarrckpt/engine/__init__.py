"""The engine: runs plans against storage and the process group (rule: imports ``plan``, ``format``
and ``storage``, never the public face above it).

``dist`` is the only process-group user, ``commit`` the commit and deletion protocol; ``saveplan``
plans a save over the group (the twin of ``loader``), ``writer`` writes a rank's shards and
commits, ``exchange`` hands joined small shards their parts, ``replicas`` checks replicas at save,
``reader`` runs read plans, ``fanread`` reads once and fans out.
"""
