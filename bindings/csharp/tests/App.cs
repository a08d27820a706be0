using System; using DParallel;
class Twice : ForwardFunction {  // runs on each device's worker thread; a throw is rethrown in the caller
  public override Tensor Forward(ulong i, Module replica, Tensor input, Device d) {
    Span<float> v = input.AsSpan();  // zero-copy view of this replica's chunk
    for (int k = 0; k < v.Length; ++k) v[k] *= 2;
    return input; } }
static class P { static void Main() {
using (var model = new Module()) using (var x = Tensor.Of(new float[] { 1, 2, 3, 4, 5, 6, 7, 8 }, 4, 2))
using (var y = Parallel.DataParallel(model, x, Device.List("cpu:0,cpu:1"), new Device("cpu:0"), 0, new Twice()))
  Console.WriteLine(string.Join(" ", y.ToArray())); } }  // DParallelException on failure
