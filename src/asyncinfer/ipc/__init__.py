"""The engine core in a process of its own (:mod:`.core_process`), the fronts' side
(:mod:`.client`) and the messages between them (:mod:`.messages`)."""
