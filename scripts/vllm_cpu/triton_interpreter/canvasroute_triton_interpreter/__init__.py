"""An interpreter-only Triton backend named `cpu` (see pyproject.toml); run with TRITON_INTERPRET=1."""
