// Ping-pong: each consumer warpgroup owns a 64-row tile.
#include "schedules.h"
namespace block_schedules {
static Register<Schedule<Shape<_64, _128, _128>, Shape<_1, _1, _1>, true>> registered("pingpong_64x128_c1x1");
}  // namespace block_schedules
