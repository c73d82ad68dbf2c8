"""The forms --data takes (docs/design.md, "Layout"): each scans its source on the driver into an
ImageTree (data.py) and reads its units in the read tasks; formats.py is the one face
(data_kind, scan_data, read_units)."""
