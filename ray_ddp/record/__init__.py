"""The run's record: what a run leaves in its folder and what reads it back, written by
the driver, Ray Train's controller and the workers, read by ``runs`` and ``report``: the
folder's names and types (folder.py), its events (events.py), what ended a worker group
(failures.py), status.json (status.py) and progress.json (progress.py). It imports none
of the packages that write it (driver/, observe/, trackers/, cli/)."""
