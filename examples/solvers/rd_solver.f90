! rd_solver.f90: the reaction-diffusion env (mpirl/envs/reaction_diffusion.py, rd_core.c) in
! Fortran, as a solver program beside an mpirl run (MPMD), one env group per ranks_per_env of
! its processes:
!
!     mpiexec -n 2 mpirl train --algo PPO --env mpirl.envs.simulation:Solver \
!         --config '{"ranks_per_env": 2, "num_envs_per_worker": 1,
!                    "env_config": {"observation_size": 8, "action_size": 4}}' \
!         : -n 2 examples/solvers/build/rd_solver_f
!
! (mpirl's 2 ranks: the driver and one rollout rank, which drives num_envs_per_worker groups
! of ranks_per_env solver processes: -n after ':' is their product times the rollout ranks.)
!
!     u_t = nu u_xx + lam u + sum_i a_i g_i(x)   on [0, pi],  u = 0 at both ends.
!
! env_config may set any key of ReactionDiffusion (n_points, nu, lam, ...), with its defaults;
! observation_size must be num_sensors and action_size num_actuators. The n_points interior
! points are split in contiguous blocks over the group's k ranks; each Euler substep swaps one
! ghost value per side with the neighbours (halo.c: the venv's Open MPI has no Fortran MPI), and
! the group's root gathers u and computes the sensors and the reward in global order. Every
! expression has its twin, in the same order, in rd_core.c and reaction_diffusion.py, so the
! trajectory is bitwise the same for any k and in the three languages: build with
! -ffp-contract=off (no FMA) and -fwrapv (splitmix64 wraps its 64-bit integers).
!
! Standalone, rd_trajectory.c's fixed run for the tests (prints "reset|step t reward obs..."):
!
!     mpiexec -n k examples/solvers/build/rd_solver_f --trajectory [seed [steps]]

!> The C helpers of halo.c.
module rd_halo
   use iso_c_binding, only: c_int, c_double
   implicit none
   interface
      integer(c_int) function halo_exchange(comm, ext, block) bind(C, name="halo_exchange_f")
         import :: c_int, c_double
         integer(c_int), value :: comm, block
         real(c_double), intent(inout) :: ext(*)
      end function
      integer(c_int) function block_gather(comm, block, count, out) &
            bind(C, name="block_gather_f")
         import :: c_int, c_double
         integer(c_int), value :: comm, count
         real(c_double), intent(in) :: block(*)
         real(c_double), intent(inout) :: out(*)
      end function
      subroutine comm_rank_size(comm, rank, size) bind(C, name="comm_rank_size_f")
         import :: c_int
         integer(c_int), value :: comm
         integer(c_int), intent(out) :: rank, size
      end subroutine
      integer(c_int) function world_init() bind(C, name="world_init_f")
         import :: c_int
      end function
      subroutine world_finalize() bind(C, name="world_finalize_f")
      end subroutine
   end interface
end module rd_halo

!> rd_core.c in Fortran: the config, splitmix64, and one simulation over a communicator.
module rd_core
   use iso_fortran_env, only: int64, real64
   use rd_halo
   implicit none
   private
   integer, parameter :: dp = real64
   !> math.pi of Python, the double nearest pi.
   real(dp), parameter :: rd_pi = 3.141592653589793_dp

   !> reaction_diffusion.py's DEFAULTS.
   type, public :: rd_config
      integer :: n_points = 32              ! interior grid points (a multiple of the ranks)
      real(dp) :: nu = 1.0_dp               ! diffusion
      real(dp) :: lam = 2.0_dp              ! reaction
      integer :: num_actuators = 4          ! Gaussians centred at pi (i + 1/2) / num_actuators
      real(dp) :: actuator_width = 0.2_dp   ! their sigma
      integer :: num_sensors = 8            ! point sensors near pi (s + 1/2) / num_sensors
      real(dp) :: a_max = 2.0_dp            ! an action of 1 drives an actuator at a_max
      real(dp) :: control_cost = 0.01_dp    ! c in -(||u||^2 dx + c ||a||^2)
      real(dp) :: dt = 0.05_dp              ! one env step, in explicit Euler substeps
      integer :: max_steps = 100            ! steps per episode, then truncated
      real(dp) :: init_amplitude = 0.1_dp   ! u0 = sum_{n=1..3} b_n sin(n x), b_n ~ U(-amp, amp)
   end type rd_config

   type, public :: rd_sim
      type(rd_config) :: c
      integer :: comm, k, rank, block, first, substeps, t
      real(dp) :: dx, dx2, h
      real(dp), allocatable :: ext(:)       ! 0:block+1, this rank's u with one ghost each side
      real(dp), allocatable :: next(:)      ! the next substep's block
      real(dp), allocatable :: shapes(:, :) ! block x num_actuators: g_i at this rank's points
      real(dp), allocatable :: sines(:, :)  ! block x 3: sin(n x) at this rank's points
      real(dp), allocatable :: forcing(:)
      real(dp), allocatable :: u_global(:)  ! n_points, on the root
      real(dp), allocatable :: a(:)         ! the scaled action
      integer, allocatable :: sensors(:)    ! 1-based grid indices
      integer(int64) :: rng_state = 0
   end type rd_sim

   public :: rd_create, rd_reset, rd_step

contains

   !> One step of splitmix64 (reaction_diffusion.py's): advances state, returns its output.
   !> Two's complement int64 holds the uint64's bits; -fwrapv makes the wrap-around defined.
   integer(int64) function splitmix64(state) result(z)
      integer(int64), intent(inout) :: state
      state = state + int(z'9E3779B97F4A7C15', int64)
      z = state
      z = ieor(z, shiftr(z, 30)) * int(z'BF58476D1CE4E5B9', int64)
      z = ieor(z, shiftr(z, 27)) * int(z'94D049BB133111EB', int64)
      z = ieor(z, shiftr(z, 31))
   end function

   real(dp) function uniform(state)
      integer(int64), intent(inout) :: state
      uniform = real(shiftr(splitmix64(state), 11), dp) * (1.0_dp / 9007199254740992.0_dp)
   end function

   real(dp) function gaussian(d, width)
      real(dp), intent(in) :: d, width
      gaussian = exp(-(d * d) / ((2.0_dp * width) * width))
   end function

   !> A simulation over comm's ranks (a Fortran handle; collective). ok false and a one-line
   !> reason in error when the config does not fit.
   subroutine rd_create(s, comm, config, ok, error)
      type(rd_sim), intent(out) :: s
      integer, intent(in) :: comm
      type(rd_config), intent(in) :: config
      logical, intent(out) :: ok
      character(len=*), intent(out) :: error
      integer :: i, j, q, mode, b, m, index
      real(dp) :: centre

      s%c = config
      s%comm = comm
      call comm_rank_size(comm, s%rank, s%k)
      ok = .false.
      error = ""
      if (config%n_points < 2 .or. config%num_actuators < 1 .or. config%num_sensors < 1 .or. &
          config%max_steps < 1 .or. .not. (config%nu > 0) .or. .not. (config%dt > 0) .or. &
          .not. (config%actuator_width > 0) .or. .not. (config%a_max > 0)) then
         error = "reaction-diffusion config out of range: n_points >= 2, num_actuators, " // &
                 "num_sensors, max_steps >= 1 and nu, dt, actuator_width, a_max > 0 are needed"
         return
      end if
      if (mod(config%n_points, s%k) /= 0) then
         write(error, '(a, i0, a, i0, a, i0)') "ReactionDiffusion splits its n_points ", &
            config%n_points, " over the group's ", s%k, &
            " ranks: n_points must be a multiple of ranks_per_env ", s%k
         return
      end if
      ok = .true.
      b = config%n_points / s%k
      m = config%num_actuators
      s%block = b
      s%first = s%rank * b
      s%dx = rd_pi / real(config%n_points + 1, dp)
      s%dx2 = s%dx * s%dx
      ! Explicit Euler is stable below dx^2 / (2 nu); 0.95 of it leaves a margin.
      s%substeps = ceiling(config%dt / ((0.95_dp * s%dx2) / (2.0_dp * config%nu)))
      s%h = config%dt / real(s%substeps, dp)
      allocate(s%ext(0:b + 1), s%next(b), s%shapes(b, m), s%sines(b, 3), s%forcing(b), s%a(m), &
               s%sensors(config%num_sensors))
      s%ext = 0
      s%t = 0
      if (s%rank == 0) then
         allocate(s%u_global(config%n_points))
      else
         allocate(s%u_global(1))
      end if
      s%u_global = 0
      do i = 1, m
         centre = (rd_pi * (real(i - 1, dp) + 0.5_dp)) / real(m, dp)
         do j = 1, b
            s%shapes(j, i) = gaussian(real(s%first + j, dp) * s%dx - centre, &
                                      config%actuator_width)
         end do
      end do
      do mode = 1, 3
         do j = 1, b
            s%sines(j, mode) = sin(real(mode * (s%first + j), dp) * s%dx)
         end do
      end do
      do q = 1, config%num_sensors
         index = ((2 * q - 1) * (config%n_points + 1) + config%num_sensors) &
                 / (2 * config%num_sensors) - 1
         s%sensors(q) = min(max(index, 0), config%n_points - 1) + 1
      end do
   end subroutine

   !> The whole u on the root (rank 0 of the group); a copy of this rank's block when k = 1.
   subroutine gather(s)
      type(rd_sim), intent(inout) :: s
      integer :: ierr
      if (s%k == 1) then
         s%u_global = s%ext(1:s%block)
      else
         ierr = block_gather(s%comm, s%ext(1:), s%block, s%u_global)
      end if
   end subroutine

   subroutine observe(s, obs)
      type(rd_sim), intent(in) :: s
      real(dp), intent(out) :: obs(:)
      integer :: q
      do q = 1, s%c%num_sensors
         obs(q) = s%u_global(s%sensors(q))
      end do
   end subroutine

   !> Start an episode: from seed when has_seed, else the stream goes on. Collective; the root
   !> fills obs (num_sensors values).
   subroutine rd_reset(s, seed, has_seed, obs)
      type(rd_sim), intent(inout) :: s
      integer(int64), intent(in) :: seed
      logical, intent(in) :: has_seed
      real(dp), intent(out) :: obs(:)
      real(dp) :: bn(3)
      integer :: n, j, b
      if (has_seed) s%rng_state = seed
      do n = 1, 3
         bn(n) = s%c%init_amplitude * (2.0_dp * uniform(s%rng_state) - 1.0_dp)
      end do
      b = s%block
      do j = 1, b
         s%ext(j) = bn(1) * s%sines(j, 1)
      end do
      do j = 1, b
         s%ext(j) = s%ext(j) + bn(2) * s%sines(j, 2)
      end do
      do j = 1, b
         s%ext(j) = s%ext(j) + bn(3) * s%sines(j, 3)
      end do
      s%t = 0
      call gather(s)
      if (s%rank == 0) call observe(s, obs)
   end subroutine

   !> One env step with action (num_actuators values, clipped to [-1, 1]; the same on every
   !> member). Collective; the root fills obs, reward and truncated.
   subroutine rd_step(s, action, obs, reward, truncated)
      type(rd_sim), intent(inout) :: s
      real(dp), intent(in) :: action(:)
      real(dp), intent(out) :: obs(:), reward
      logical, intent(out) :: truncated
      integer :: i, j, b, m, sub, ierr
      real(dp) :: v, f, l, c, r, h, nu, lam, dx2, energy, effort
      b = s%block
      m = s%c%num_actuators
      do i = 1, m
         ! Comparisons, not min/max: a NaN goes through as in C and NumPy's clip.
         v = action(i)
         if (action(i) < -1.0_dp) v = -1.0_dp
         if (action(i) > 1.0_dp) v = 1.0_dp
         s%a(i) = v * s%c%a_max
      end do
      do j = 1, b
         f = s%a(1) * s%shapes(j, 1)
         do i = 2, m
            f = f + s%a(i) * s%shapes(j, i)
         end do
         s%forcing(j) = f
      end do
      h = s%h
      nu = s%c%nu
      lam = s%c%lam
      dx2 = s%dx2
      do sub = 1, s%substeps
         if (s%k > 1) ierr = halo_exchange(s%comm, s%ext, b)
         do j = 1, b
            l = s%ext(j - 1)
            c = s%ext(j)
            r = s%ext(j + 1)
            s%next(j) = c + h * (((nu * ((l - 2.0_dp * c) + r)) / dx2 + lam * c) + s%forcing(j))
         end do
         s%ext(1:b) = s%next
      end do
      s%t = s%t + 1
      reward = 0
      truncated = .false.
      call gather(s)
      if (s%rank /= 0) return
      energy = 0
      effort = 0
      do j = 1, s%c%n_points
         energy = energy + s%u_global(j) * s%u_global(j)
      end do
      do i = 1, m
         effort = effort + s%a(i) * s%a(i)
      end do
      call observe(s, obs)
      reward = -(energy * s%dx + s%c%control_cost * effort)
      truncated = s%t >= s%c%max_steps
   end subroutine

end module rd_core

program rd_solver_f
   use iso_c_binding, only: c_long, c_double
   use iso_fortran_env, only: int64, error_unit
   use mpirl
   use rd_core
   use rd_halo
   implicit none
   character(len=32) :: mode

   mode = ""
   if (command_argument_count() >= 1) call get_command_argument(1, mode)
   if (mode == "--trajectory") then
      call trajectory()
   else
      call solve()
   end if

contains

   !> The config's keys over the defaults, read the same on every process.
   subroutine read_config(s, c)
      type(mpirl_solver), intent(in) :: s
      type(rd_config), intent(out) :: c
      c%n_points = int(mpirl_config_long(s, "n_points", int(c%n_points, c_long)))
      c%nu = mpirl_config_double(s, "nu", c%nu)
      c%lam = mpirl_config_double(s, "lam", c%lam)
      c%num_actuators = int(mpirl_config_long(s, "num_actuators", &
                                              int(c%num_actuators, c_long)))
      c%actuator_width = mpirl_config_double(s, "actuator_width", c%actuator_width)
      c%num_sensors = int(mpirl_config_long(s, "num_sensors", int(c%num_sensors, c_long)))
      c%a_max = mpirl_config_double(s, "a_max", c%a_max)
      c%control_cost = mpirl_config_double(s, "control_cost", c%control_cost)
      c%dt = mpirl_config_double(s, "dt", c%dt)
      c%max_steps = int(mpirl_config_long(s, "max_steps", int(c%max_steps, c_long)))
      c%init_amplitude = mpirl_config_double(s, "init_amplitude", c%init_amplitude)
   end subroutine

   !> The solver: RESETs and STEPs from the run until it ends.
   subroutine solve()
      type(mpirl_solver) :: s
      type(rd_config) :: config
      type(rd_sim) :: sim
      integer :: ierr, command, code
      integer(c_long) :: seed
      logical :: ok, truncated
      real(c_double) :: reward
      real(c_double), allocatable :: action(:), obs(:)
      character(len=256) :: error

      call mpirl_init(s, ierr)
      if (ierr /= 0) then
         call mpirl_finalize(s, code)
         call exit(code)
      end if
      call read_config(s, config)
      if (mpirl_obs_size(s) /= config%num_sensors .or. &
          mpirl_action_size(s) /= config%num_actuators) then
         write(error, '(6(a, i0), a)') "rd_solver_f has ", config%num_sensors, &
            " sensors and ", config%num_actuators, " actuators: set env_config " // &
            "observation_size ", config%num_sensors, " and action_size ", &
            config%num_actuators, " (got ", mpirl_obs_size(s), " and ", &
            mpirl_action_size(s), ")"
         call fail(s, error)
      end if
      call rd_create(sim, mpirl_group_comm(s), config, ok, error)
      if (.not. ok) call fail(s, error)
      allocate(action(config%num_actuators), obs(config%num_sensors))
      action = 0
      obs = 0
      do
         call mpirl_next(s, action, seed, command)
         if (command == MPIRL_END) exit
         if (command == MPIRL_RESET) then
            call rd_reset(sim, int(seed, int64), seed /= -1, obs)
            call mpirl_send(s, obs, 0.0_c_double, .false., .false., ierr)
         else
            call rd_step(sim, action, obs, reward, truncated)
            call mpirl_send(s, obs, reward, .false., truncated, ierr)
         end if
      end do
      call mpirl_finalize(s, code)
      call exit(code)
   end subroutine

   !> End the run with this line (every member calls it), then exit.
   subroutine fail(s, error)
      type(mpirl_solver), intent(inout) :: s
      character(len=*), intent(in) :: error
      integer :: code
      call mpirl_fail(s, error)
      call mpirl_finalize(s, code)
      call exit(code)
   end subroutine

   !> rd_trajectory.c's action sequence (tests/programs/rd_trajectories.py has the same).
   real(c_double) function trajectory_action(t, i)
      integer, intent(in) :: t, i
      trajectory_action = real(mod(7 * t + 3 * i, 11) - 5, c_double) / 5.0_c_double
   end function

   subroutine print_line(what, t, reward, obs)
      character(len=*), intent(in) :: what
      integer, intent(in) :: t
      real(c_double), intent(in) :: reward, obs(:)
      ! 17 significant digits: each value reads back as the same double.
      write(*, '(a, 1x, i0, *(1x, es24.16e3))') what, t, reward, obs
   end subroutine

   !> rd_trajectory.c's run over COMM_WORLD, without mpirl: reset from seed, steps, a reset
   !> without a seed halfway; the root prints each line.
   subroutine trajectory()
      type(rd_config) :: config
      type(rd_sim) :: sim
      integer :: world, rank, k, t, i, steps
      integer(int64) :: seed
      logical :: ok, truncated
      real(c_double) :: reward
      real(c_double), allocatable :: action(:), obs(:)
      character(len=256) :: error, word

      seed = 12345
      steps = 40
      if (command_argument_count() >= 2) then
         call get_command_argument(2, word)
         read(word, *) seed
      end if
      if (command_argument_count() >= 3) then
         call get_command_argument(3, word)
         read(word, *) steps
      end if
      world = world_init()
      call comm_rank_size(world, rank, k)
      call rd_create(sim, world, config, ok, error)
      if (.not. ok) then
         if (rank == 0) write(error_unit, '(a)') "rd_solver_f: " // trim(error)
         call world_finalize()
         call exit(2)
      end if
      allocate(action(config%num_actuators), obs(config%num_sensors))
      obs = 0
      call rd_reset(sim, seed, .true., obs)
      if (rank == 0) call print_line("reset", 0, 0.0_c_double, obs)
      do t = 0, steps - 1
         if (t == steps / 2) then
            call rd_reset(sim, seed, .false., obs)
            if (rank == 0) call print_line("reset", t, 0.0_c_double, obs)
         end if
         do i = 1, config%num_actuators
            action(i) = trajectory_action(t, i - 1)
         end do
         call rd_step(sim, action, obs, reward, truncated)
         if (rank == 0) call print_line("step", t, reward, obs)
      end do
      call world_finalize()
   end subroutine

end program rd_solver_f
