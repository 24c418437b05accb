"""The native decode step: a whole transformer step in one C++ call (``decode.cpp`` and its headers); ``step.py`` builds the extension and describes a model to it."""
