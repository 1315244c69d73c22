"""A torch.save (.pt) payload read without copying its tensors: the zip layout, the pickled structure, byte ranges."""

from .pt_in_file import in_file_fields, torch_notes_storage_offsets
from .pt_structure import structure_on_meta
from .torch_zip import ZipEntry, stored_data_ranges, zip_entries

__all__ = [
    "ZipEntry",
    "in_file_fields",
    "stored_data_ranges",
    "structure_on_meta",
    "torch_notes_storage_offsets",
    "zip_entries",
]
