package dparallel_test

import (
	"fmt"
	"log"

	"dparallel.org/dparallel"
)

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}

// The README's example: a forward written in Go runs on two logical CPU
// devices, each on its half of the batch; the outputs are gathered back.
func Example() {
	lib, err := dparallel.Load() // dlopen($DP_LIBRARY), one dlsym of dp_get_api
	check(err)
	defer lib.Close()
	model, err := lib.NewModule()
	check(err)
	defer model.Close()
	x, err := lib.TensorFromFloat32s([]float32{1, 2, 3, 4}, []int64{4, 1}, dparallel.CPU(0))
	check(err)
	defer x.Close()
	devices := []dparallel.Device{dparallel.CPU(0), dparallel.CPU(1)}
	y, err := lib.DataParallel(model, x, devices, dparallel.CPU(0), 0, func(i int, replica *dparallel.Module,
		in *dparallel.Tensor, dev dparallel.Device) (*dparallel.Tensor, error) {
		rows, err := in.Float32s() // this replica's rows, without a copy
		if err != nil {
			return nil, err
		}
		return lib.TensorFromFloat32s([]float32{2 * rows[0], 2 * rows[1]}, []int64{2, 1}, dev)
	})
	check(err)
	defer y.Close()
	values, err := y.Float32s()
	check(err)
	fmt.Println(values)
	// Output: [2 4 6 8]
}
