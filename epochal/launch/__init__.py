"""Starting, watching and restarting epochal's processes.

- :mod:`~epochal.launch.launcher`: ``epochal run``, an in-process coordinator and N local workers;
- :mod:`~epochal.launch.attempt`: one attempt of such a run, its workers started, watched,
  replaced and stopped;
- :mod:`~epochal.launch.supervisor`: ``epochal worker``, one worker on a machine of its own;
- :mod:`~epochal.launch.restarts`: the one restart loop, for the launcher's runs, the
  supervisor's worker and the ``epochal coordinator`` service;
- :mod:`~epochal.launch.processes`: children that die with their parent, process-group kills;
- :mod:`~epochal.launch.rerun`: the run ``--resume`` continues, and the command line that resumes
  an unfinished run.
"""
