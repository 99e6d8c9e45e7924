"""``decodefs.reader``, where ``read_array_into`` and ``read_stored_rows`` are documented
(docs/mount.md): the client's reader (decodefs.client), re-exported."""

from .client import flush_reports, read_array, read_array_into, read_stored_rows

__all__ = ["flush_reports", "read_array", "read_array_into", "read_stored_rows"]
