"""A torch.save (.pt) payload read without copying its tensors twice: the zip layout, and torch's private path."""

from ._private_torch import direct_reads, in_file_payload
from .torch_zip import ZipEntry, stored_data_ranges, zip_entries

__all__ = ["ZipEntry", "direct_reads", "in_file_payload", "stored_data_ranges", "zip_entries"]
