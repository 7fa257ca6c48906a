"""CURVE security for the control plane: who may talk to the coordinator, and privately.

What it protects, when the coordinator is given keys:

- **Admission.** Only workers whose public key is in the coordinator's allow-list directory
  complete the ZeroMQ handshake. Everyone else (an unknown key, a client without CURVE) is refused
  inside libzmq by the ZAP authenticator, which runs from before the socket binds until after it
  closes, with the ZAP domain enforced: no byte of theirs reaches the coordinator's code.
- **The coordinator's identity.** A worker only talks to the holder of the coordinator secret key
  matching the public key it was given.
- **The messages.** Every control message (hello and its job token, epoch plans, losses,
  decisions, abort) is encrypted and authenticated in transit (CurveZMQ, per-connection keys).

What it does not protect:

- **The data plane.** ``torch.distributed`` traffic (the TCPStore, NCCL and gloo collectives:
  tensors, gradients, checkpoint coordination) is neither encrypted nor authenticated. Run it on
  a trusted network or a VPN; the store address the coordinator hands out is not secret.
- **Admitted workers from each other.** Any allow-listed key may take any rank and choose any
  routing identity; keys are not bound to ranks. Once admitted, a worker's frames must come from
  the key its hello came with (its session is bound to it). The job token remains a separate
  check.
- **Key files at rest.** Secret files are written mode 0600 in a 0700 directory and are not
  encrypted; anyone who can read one is that worker (or that coordinator). There is no
  revocation while a run is live: the allow-list is read at start, so restart the coordinator to
  drop a key.
- **Availability.** A peer that can reach the port can still open connections and make the
  coordinator spend handshakes on them; CURVE stops it from doing anything more.
- **Without keys.** A coordinator given no keys speaks plain ZeroMQ, as before: bind it to
  loopback (the default) or a network you trust.

Modules: :mod:`.keys` writes and loads key files, :mod:`.curve` secures the sockets,
:mod:`.cli` is ``epochal keys``.
"""

from epochal.environment import CURVE_KEY_ENV, CURVE_SERVER_KEY_ENV
from epochal.security.curvekeys import (
    DEFAULT_DOMAIN,
    ClientSecurity,
    ServerSecurity,
    describe_handshake_failure,
    secure_client,
    secure_server,
)
from epochal.security.keys import (
    KeyDirectory,
    generate,
    load_allowed,
    load_client_keys,
    load_coordinator_public,
    load_public,
    load_server_keys,
)

__all__ = [
    "CURVE_KEY_ENV",
    "CURVE_SERVER_KEY_ENV",
    "DEFAULT_DOMAIN",
    "ClientSecurity",
    "KeyDirectory",
    "ServerSecurity",
    "describe_handshake_failure",
    "generate",
    "load_allowed",
    "load_client_keys",
    "load_coordinator_public",
    "load_public",
    "load_server_keys",
    "secure_client",
    "secure_server",
]
