"""The cluster as the driver sees it: attaching to Ray, whether the run fits, where the
workers go, and the environment they get."""
