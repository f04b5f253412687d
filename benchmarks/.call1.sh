set -x
source benchmarks/gpu_env.sh
C=$(cat GIT_COMMIT | cut -c1-7); D=$OUT/call1_$C; mkdir -p $D; cp $OUT/device.csv $OUT/versions.txt $D/
timeout 170 python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_mla_triton.py tests/kernels/test_dsa_triton.py tests/kernels/test_dsa_triton_tiles.py > $D/gpu_tests_mla_dsa.log 2>&1; tail -3 $D/gpu_tests_mla_dsa.log
timeout 330 python3 -m benchmarks.kernels_mla --out $D --tiles 16,64,4,2 32,64,8,2 64,32,8,2 32,32,8,3 --forms heads keys > $D/kernels_mla.log 2>&1; tail -2 $D/kernels_mla.log
timeout 80 python3 -m benchmarks.kernels_dsa --out $D --decode-only > $D/kernels_dsa.log 2>&1; tail -2 $D/kernels_dsa.log
