"""Several ranks: cross-rank collectives (``collectives.py``), FSDP2 sharding of a team (``fsdp.py``)
and the Lightning strategies that drive them (``strategies.py``)."""
