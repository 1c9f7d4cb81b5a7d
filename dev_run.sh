export PYTHONPATH=$PWD
BITNETLM_TRITON_TUNE_VERBOSE=1 python benchmarks/gpu_profile.py --batches 3,8,16,64 > $OUT/new.txt 2>&1
(cd .scratch/basepkg && PYTHONPATH=$PWD python benchmarks/gpu_profile.py --batches 3,8,16,64 > $OUT/base.txt 2>&1)
python benchmarks/gpu_profile.py --batches 3,8,16,64 > $OUT/new2.txt 2>&1
