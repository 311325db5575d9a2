#!/usr/bin/env bash
# session 5 call 5 (1 x H200; the 2-GPU kind was withdrawn): pinned table uploads
O=$OUT; nvidia-smi -L > $O/machine.txt
python3 -m pytest -q -p no:cacheprovider tests/backends/test_pack_upload.py -rs > $O/upload_new.log 2>&1; echo "new rc=$?" >> $O/steps.txt
# the same test against the previous upload (pageable .to(device)): expected to fail
sed -i 's/    return table.pin_memory().to(device, non_blocking=True)/    return table.to(device)/' nereus/backends/triton/tables.py
grep -n "return table" nereus/backends/triton/tables.py >> $O/steps.txt
python3 -m pytest -q -p no:cacheprovider tests/backends/test_pack_upload.py > $O/upload_old.log 2>&1; echo "old rc=$?" >> $O/steps.txt
git checkout nereus/backends/triton/tables.py 2>/dev/null || true
cat $O/steps.txt; tail -5 $O/upload_new.log; grep -h "waited\|passed\|failed" $O/upload_old.log | tail -4
