#!/usr/bin/env bash
# session 6, 1 x H200: copy_speed.py on the tree with widened / memcpy copies, and the CUDA unit tests
O=/tmp/o; mkdir -p $O
nvidia-smi -L > $O/machine.txt; git log -1 --format=%H >> $O/machine.txt 2>/dev/null
timeout 150 python3 benchmarks/multi_gpu/copy_speed.py > $O/copy_speed.log 2>&1; echo "copy_speed rc=$?" >> $O/steps.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_room_cuda.py tests/runtime/test_offload_cuda.py tests/backends/test_pack_upload.py tests/runtime/test_planned_views.py tests/runtime/test_copy_pairs.py > $O/unit.log 2>&1; echo "unit rc=$?" >> $O/steps.txt
tar czf $OUT/single2.tgz -C $O .
cat $O/steps.txt; tail -2 $O/unit.log; grep -v "^{" $O/copy_speed.log
