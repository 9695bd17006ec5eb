"""The native CPU wing: the C++ handlers (`*.cc`, `*.h`), their build and cache (`build`) and the panel layout
they read weights in (`packed`). Each slot's `native` module calls its handler."""
