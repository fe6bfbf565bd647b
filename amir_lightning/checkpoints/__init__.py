"""Checkpoints: what one holds, how it is written, which one a run resumes from, and the checks before it loads.

``contents.py`` (what trains, the base model's identity, the random states), ``writing.py`` (atomic, local or
remote), ``resume.py`` (``--ckpt_path last|auto``, remote folders) and ``checks.py`` (a whole file, of this model).
"""
