"""The parts a worker's :class:`~epochal.worker.session.Session` is composed of.

:class:`~epochal.worker.sessionparts.standing.Standing` is what the session knows of the run and
of this rank's place in it; each other module is one concern the session holds and calls:
:mod:`~epochal.worker.sessionparts.exchange` (what this rank awaits an answer to, and the
answers), :mod:`~epochal.worker.sessionparts.savepoints` (checkpoints),
:mod:`~epochal.worker.sessionparts.reattach` (hello again to a stalled or restarted coordinator)
and :mod:`~epochal.worker.sessionparts.worldchange` (a new world after a lost rank). None of them
calls another: the session does, in the order its epoch loop says.
"""
