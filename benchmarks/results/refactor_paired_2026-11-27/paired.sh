#!/usr/bin/env bash
# Paired bench: the code at the session's start (/tmp/base) vs now (/work/main), in rotation.
source /work/venv/bin/activate
out=/tmp/paired; rm -rf $out; mkdir -p $out; cd /tmp
for r in 1 2 3; do
  for tree in base main; do
    root=/tmp/base; [ $tree = main ] && root=/work/main
    for dev in cpu sim; do
      if [ $dev = cpu ]; then c=offload-cpu,offload-nvme; else c=offload-cpu; fi
      PYTHONPATH=$root:$root/benchmarks python $root/benchmarks/train.py --device $dev --contenders $c \
        --warmup 2 --steps 5 --nvme-dir /tmp/paired-nvme --out $out/$tree-$dev-$r > $out/$tree-$dev-$r.json 2>$out/$tree-$dev-$r.err
      echo "$tree $dev $r rc=$?" >> $out/log
    done
  done
done
echo done >> $out/log
