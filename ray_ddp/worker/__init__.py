"""Everything that runs on a Ray Train worker: the loop and its parts."""
