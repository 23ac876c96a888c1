"""A real pyarrow filesystem (the local disk) whose first N opens fail the way a dropped
S3 connection does: for tests of what ray_ddp does with transient storage errors."""

import pyarrow.fs as pafs


class FlakyHandler(pafs.FileSystemHandler):
    """Delegates to the local filesystem; ``fail_opens`` opens (reads or writes) of paths
    containing ``match`` raise OSError first."""

    def __init__(self, fail_opens: int, match: str = ""):
        self.local = pafs.LocalFileSystem()
        self.fail_opens, self.match = fail_opens, match
        self.failed = 0

    def _maybe_fail(self, path):
        if self.match in path and self.failed < self.fail_opens:
            self.failed += 1
            raise OSError(f"AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56 ({path})")

    def get_type_name(self):
        return "flaky"

    def equals(self, other):
        return self is other

    def get_file_info(self, paths):
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("refusing to delete the root")

    def delete_file(self, path):
        self.local.delete_file(path)

    def move(self, src, dest):
        self.local.move(src, dest)

    def copy_file(self, src, dest):
        self.local.copy_file(src, dest)

    def open_input_stream(self, path):
        self._maybe_fail(path)
        return self.local.open_input_stream(path)

    def open_input_file(self, path):
        self._maybe_fail(path)
        return self.local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        self._maybe_fail(path)
        return self.local.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        self._maybe_fail(path)
        return self.local.open_append_stream(path, metadata=metadata)

    def normalize_path(self, path):
        return path


def flaky_fs(fail_opens: int, match: str = "") -> pafs.PyFileSystem:
    return pafs.PyFileSystem(FlakyHandler(fail_opens, match))
