"""The control-plane protocol: message types, their msgpack codec, version and limits.

Pure data: no I/O, no torch, no zmq. Both the coordinator and the worker import it. Every message
class (and the rest of :mod:`epochal.protocol.messages`) is exported from here as it is defined
there: a new message needs no line in this file.
"""

from epochal.protocol.codec import decode as decode
from epochal.protocol.codec import encode as encode
from epochal.protocol.messages import *  # noqa: F403
