import sys

from harness.cli import main
from harness.simbox.box import install_source

install_source()  # GPU discovery reads the simulated box wherever PD_HARNESS_SIMULATED_GPUS is set
sys.exit(main())
