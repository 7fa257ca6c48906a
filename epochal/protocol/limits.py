"""The protocol's version, the keys every frame has, and every bound a frame is held to.

A frame's size alone bounds little: 64 KiB of nested empty arrays would decode to a few MiB of
Python objects. So the codec builds only what a frame's message declares (msgspec decodes it
straight into the message's class, and skips the values of fields this version does not know
without building them), and holds what it builds to these bounds, each sized to the largest
legitimate message. They belong to the major version: a newer
minor version may add fields, never raise a bound (a peer would refuse its frames).

Constants only, no imports: every other protocol module reads them, and
``from epochal.protocol.limits import *`` exports exactly these names.
"""

PROTOCOL_VERSION = 6
"""The major version, a frame's ``v``. A peer refuses a frame of any other major version
(:class:`~epochal.errors.ProtocolVersionMismatch`). Bumped for a field without a default, a field
removed, a message type removed or made required, or a changed meaning; a new message type is
optional instead (:attr:`~epochal.protocol.registry.Message.optional`)."""

PROTOCOL_MINOR = 7
"""The minor version, a frame's ``m`` (left out when 0). Bumped for a new field, which must have a
default, or a new optional message type: peers of one major version interoperate whatever their
minor versions, each skipping the fields it does not know and taking the default of those it
misses, and sending an optional message type only to a peer that said it understands it."""

VERSION_KEY = "v"
TYPE_KEY = "t"
MINOR_KEY = "m"
SESSION_KEY = "s"
"""Frame key of the session a worker presents with every frame after its hello was admitted.

At most :data:`MAX_SESSION_CHARS` characters."""

FRAME_KEYS = (VERSION_KEY, TYPE_KEY, MINOR_KEY, SESSION_KEY)
"""The keys of a frame that are not a message's fields: ``v`` and ``t`` lead it, ``m`` and ``s``
follow when present. No message may declare a field of these names."""

MAX_FRAME_BYTES = 64 * 1024
"""Largest frame either side accepts, also set as ``ZMQ_MAXMSGSIZE`` on both sockets: libzmq drops
the connection of a peer that announces a larger one before it holds any of it. Every legitimate
message fits, its strings at their longest in four-byte characters (``tests/protocol`` checks the
largest of each type), because every string field is bounded below and a model's parameter list
travels in pages (:class:`~epochal.protocol.messages.ModelPage`)."""

MAX_TEXT_CHARS = 8 * 1024
"""Longest free text (a failure's, an abort's or a refusal's reason);
:func:`~epochal.protocol.strings.clip` cuts longer reasons to it. In four-byte characters it fills
half a frame; no string in a frame, known or skipped, may take more bytes than that."""

MAX_NAME_CHARS = 1024
"""Longest name-like string: job, token, worker id, host, address, run id, digest, version, a
parameter's name or dtype, a heartbeat's code location. Real ones are a few dozen characters."""

MAX_PATH_CHARS = 4096
"""Longest path a message carries (the checkpoint directory): Linux's PATH_MAX."""

MAX_PARAMS = 100_000
"""Most entries (parameters and buffers) a model's fingerprint may count: the coordinator reads at
most this many from one worker when it fetches a parameter list."""

MAX_PAGE_PARAMS = 4096
"""Most entries one :class:`~epochal.protocol.messages.ModelPage` may hold (a page is also bounded
by the frame size: the shortest entry takes about 20 bytes)."""

MAX_SESSION_CHARS = 64
"""Longest session secret a Joined or Welcome may carry (the coordinator issues 43 characters)."""

MAX_OPTIONAL_TYPES = 32
"""Most optional message types a hello or a welcome may say it understands."""

MAX_TYPE_NAME_CHARS = 64
"""Longest message type name a hello or a welcome may list (every wire name is far shorter)."""

MAX_SHAPE_DIMS = 64
"""Most dimensions one parameter's shape may have."""

MAX_METRICS = 64
"""Most named metrics one split of an epoch may report (besides the loss)."""

MAX_METRIC_NAME_CHARS = 64
"""Longest metric name."""

MAX_KEY_CHARS = 64
"""Longest field name, known or not; every declared one is far shorter."""

MAX_FIELDS = 24
"""Most fields one map may hold, known and unknown together (Welcome declares 17): a frame besides
its own keys (:data:`FRAME_KEYS`), a nested record. (A map inside a skipped value is not read.)"""

MAX_LIST_ITEMS = MAX_PAGE_PARAMS
"""Longest list any frame may hold: a list field declares its own bound
(:class:`~epochal.protocol.constraints.Items`), at most this."""
