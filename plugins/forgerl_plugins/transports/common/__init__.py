"""What the ``nccl`` and ``rdma`` transports share. Both push each version to receivers
that register with a control store the sender hosts (a torch ``TCPStore`` whose values
are signed with the run's secret), lay a version out in one flat buffer, and wait for
every receiver's acknowledgement:

* :mod:`.auth`: the run's transport secret, and store values signed with it;
* :mod:`.control`: the control store, bounded operations on it, deadlines and backoff;
* :mod:`.membership`: receivers' registration, acknowledgements and goodbyes;
* :mod:`.layout`: a version's flat layout, its chunks and their checksums;
* :mod:`.endpoints`: the bookkeeping their senders and receivers have in common;
* :mod:`.hosting`: the transport object that hosts the store and tells receivers where it is;
* :mod:`.options`: the options both take (host, port, secret file, timeouts), declared once
  (the base of ``NcclTransport.Options`` and ``RdmaTransport.Options``).

Not a plugin: it registers no backend.
"""
