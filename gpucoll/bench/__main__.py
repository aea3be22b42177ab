"""python -m gpucoll.bench <collective> [nccl-tests flags]"""

import sys

from gpucoll.bench.cli import main

if __name__ == "__main__":  # spawned ranks import this module as __mp_main__: they must not run main()
    sys.exit(main())
