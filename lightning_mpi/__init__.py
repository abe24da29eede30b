"""lightning_mpi: PyTorch Lightning strategies for data-parallel training over MPI."""
__version__ = "0.1.0"
