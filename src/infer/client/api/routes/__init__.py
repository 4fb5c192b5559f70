"""The front's routes by family; client/api/app.py wires them to paths."""
