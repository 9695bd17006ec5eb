"""`python -m qwen35_lib.kernels.native [--isa NAME|all]`: build every native kernel now (`build.main`). Here and not
as `-m ...native.build`: importing the package `qwen35_lib` loads `build` first, and runpy warns at a module that is
already imported."""

from qwen35_lib.kernels.native.build import main

raise SystemExit(main())
