"""The engine core in a process of its own, and the HTTP front that talks to it.

``asyncinfer serve`` runs the engine (coordinator, scheduler, policy, runner) in an engine
core process and the HTTP work (parsing, tokenizing, detokenizing, streaming) in one or more
front processes, so that neither waits on the other's Python. Between them, ZeroMQ sockets
over Unix domain sockets carry msgpack messages (:mod:`.messages`): requests and aborts in;
out, one message per engine round per front, with every request's new tokens.

:mod:`.core` is the core's side (:class:`~.core.EngineCore`, the process entry),
:mod:`.client` the front's (:class:`~.client.EngineClient`, the ``Engine`` the HTTP app
serves), :mod:`.process` what both use to watch each other's processes.
"""
