import sys

from kvfence.sim.run import main

sys.exit(main())
