// Ping-pong, 1x2 clusters.
#include "schedules.h"
namespace block_schedules {
static Register<Schedule<Shape<_64, _128, _128>, Shape<_1, _2, _1>, true>> registered("pingpong_64x128_c1x2");
}  // namespace block_schedules
